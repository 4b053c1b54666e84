"""The scale benchmark (``benchmarks/suites/scale/``, ``benchmarks/reports/scale.py``) at a
tiny size: its records, its report, the PNG (or the note saying why there is none) and the
generated section of its docs page."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks.harness.state import tensor_bytes
from benchmarks.reports import scale as scale_report
from benchmarks.suites.scale import big as big_state
from benchmarks.suites.scale import cli, measure
from benchmarks.suites.scale import figures as scale_figures
from benchmarks.suites.scale import tensors as many_tensors

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "guides" / "scale.md"
KEYS = {
    "sweep",
    "case",
    "size",
    "figure",
    "ours",
    "baseline",
    "baseline_name",
    "unit",
    "ratio",
    "target",
    "target_absolute",
    "met",
    "detail",
}
MACHINE = {"cpu_model": "test CPU", "cpu_available": 2, "ram_gib": 4, "torch": "x"}


def _strict_json(text: str) -> Any:
    """JSON without NaN or infinity (which ``json.loads`` would accept)."""

    def refuse(name: str) -> None:
        raise AssertionError(f"{name} in the JSON")

    return json.loads(text, parse_constant=refuse)


def _row(sweep: str, size: float, figure: str, ours: float, baseline: float | None, **kw: Any):
    return scale_figures.record(sweep, f"{size:g}", size, figure, ours, baseline, "base", "s", **kw)


SAMPLE = [
    _row("tensors", 500, "stall, full save", 0.01, 0.2, target=scale_figures.STALL_TARGET),
    _row("tensors", 2000, "stall, full save", 0.03, 0.5, target=scale_figures.STALL_TARGET),
    _row("tensors", 500, "restore, fresh process", 0.3, 0.2, target=scale_figures.RESTORE_TARGET),
    _row("tensors", 2000, "restore, fresh process", 0.5, 0.5, target=scale_figures.RESTORE_TARGET),
    _row("big", 0.064, "stall, steady save", 0.02, 0.01),
    _row("big", 0.128, "stall, steady save", 0.04, 0.02),
    {"sweep": "ranks", "ranks": 16, "figure": "commit", "ours": 0.1, "unit": "s"},
    {"sweep": "ranks", "ranks": 256, "figure": "commit", "ours": 0.4, "unit": "s"},
]


def _check_records(records: list[dict[str, Any]], sweep: str) -> None:
    assert records
    for r in records:
        assert set(r) == KEYS, r
        assert r["sweep"] == sweep
        assert r["unit"] in {"s", "B", "x"}
        assert isinstance(r["ours"], float) and r["ours"] >= 0, r
        if r["ratio"] is not None:
            assert r["ratio"] == pytest.approx(r["ours"] / r["baseline"])
        assert r["met"] is None or isinstance(r["met"], bool)
        assert (r["met"] is None) == (r["target"] is None), r


# ----------------------------------------------------------------------------- the records


def test_a_record_compares_its_ratio_or_its_value_with_the_target() -> None:
    r = scale_figures.record("tensors", "c", 1, "stall", 0.05, 1.0, "torch.save", "s", 0.1)
    assert r["ratio"] == pytest.approx(0.05) and r["met"] is True
    assert scale_figures.record("tensors", "c", 1, "stall", 0.5, 1.0, "b", "s", 0.1)["met"] is False
    assert scale_figures.record("tensors", "c", 1, "stall", 0.5, 1.0, "b", "s")["met"] is None
    per_tensor = scale_figures.record(
        "tensors", "c", 1, "manifest", 40.0, None, None, "B", 64.0, True
    )
    assert per_tensor["ratio"] is None and per_tensor["met"] is True
    # a multiple of the state has no ratio to a baseline near zero
    assert scale_figures.record("big", "c", 1, "peak", 1.5, 0.01, "b", "x")["ratio"] is None


def test_the_sweeps_measure_every_figure_at_a_tiny_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    restores: list[tuple[str, str, int | None]] = []

    def restore_here(kind: str, path: Path, repeats: int, step: int | None = None) -> float:
        """The restore in this process (the command's test runs it in fresh ones)."""
        from lightning_incremental.core import CheckpointStore

        restores.append((kind, Path(path).name, step))
        started = time.perf_counter()
        if kind == "torch":
            loaded = torch.load(path, weights_only=True)
        else:
            loaded = CheckpointStore(path).load(step)
        assert tensor_bytes(loaded) > 0
        return time.perf_counter() - started

    monkeypatch.setattr(measure, "fresh_restore", restore_here)
    tensors = many_tensors.tensors_sweep(64, tmp_path, repeats=1)
    _check_records(tensors, "tensors")
    figures = [r["figure"] for r in tensors]
    for kind in ("full", "unchanged", "1% changed"):
        assert f"stall, {kind} save" in figures and f"time to durable, {kind} save" in figures
    assert "restore, fresh process" in figures
    manifest = next(r for r in tensors if r["figure"].startswith("manifest"))
    assert manifest["target_absolute"] and manifest["unit"] == "B" and manifest["ours"] > 0

    big = big_state.big_sweep(2_000_000, tmp_path, repeats=1)
    _check_records(big, "big")
    figures = [r["figure"] for r in big]
    assert "stall, steady save" in figures and "time to durable, steady save" in figures
    assert sum(f.startswith("restore") for f in figures) == 2
    stall = next(r for r in big if r["figure"] == "stall, steady save")
    assert stall["target"] == scale_figures.COPY_STALL_TARGET and stall["ratio"] is not None
    for peak in (r for r in big if r["figure"].startswith("peak extra host memory")):
        assert peak["unit"] == "x" and peak["ratio"] is None and peak["target_absolute"]
        assert peak["met"] == (peak["ours"] <= scale_figures.PEAK_MEMORY_TARGET_X)
    assert all(r["case"] == big[0]["case"] and r["size"] == pytest.approx(0.002) for r in big)
    # the chain's restore says what it decoded: 8 tensors of 250 kB, one chunk each
    chain = next(r for r in big if "chain" in r["figure"])
    assert re.fullmatch(
        rf"step {big_state.CHAIN} of the chain restored 8 chunks \((\d+ [a-z ]+(, )?)+\), "
        r"reading \d+\.\d\dx their raw bytes",
        chain["detail"],
    ), chain["detail"]
    # the time to durable says what codec_effort="auto" chose for the saves it timed
    durable = next(r for r in big if r["figure"] == "time to durable, steady save")
    said = re.fullmatch(
        r"the steady saves timed for durability under codec_effort=\"auto\": (\d) of (\d) stored "
        r"their changed chunks as they are, (\d) coded them in full, (\d) were paced"
        r"( \(stored \d+-\d+ % of them as they are\))?; the fastest "
        r"(stored them as they are|coded them|was paced)",
        durable["detail"],
    )
    assert said, durable["detail"]
    fast, timed, full, paced = (int(said[i]) for i in (1, 2, 3, 4))
    assert timed == 2 and fast + full + paced == timed  # steps 3 and 5 (step 4: memory)
    assert bool(said[5]) == (paced > 0)
    text = scale_report.markdown({}, {}, big, [])
    assert f"Note: {chain['case']}, {chain['detail']}." in text
    assert f"Note: {durable['case']}, {durable['detail']}." in text
    assert restores == [
        ("ours", "tensors-64", None),
        ("torch", "tensors-64.pt", None),
        ("torch", "big.pt", None),
        ("ours", "big-store", 1),
        ("ours", "big-store", big_state.CHAIN),
    ]
    assert not list(tmp_path.iterdir()), "the sweeps remove their stores and files"


def test_the_ranks_sweep_is_skipped_with_a_note_or_takes_the_modules_records(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "benchmarks.suites.scale.ranks", None)  # not importable
    rows, note = cli.ranks_sweep((2, 4))
    assert rows == [] and note and "skipped" in note

    seen: list[tuple[int, ...]] = []

    def run(ranks: tuple[int, ...]) -> list[dict[str, Any]]:
        seen.append(ranks)
        return [{"ranks": n, "figure": "commit", "ours": 0.01 * n, "unit": "s"} for n in ranks]

    fake = types.ModuleType("benchmarks.suites.scale.ranks")
    fake.run = run  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "benchmarks.suites.scale.ranks", fake)
    rows, note = cli.ranks_sweep((2, 4))
    assert note is None and seen == [(2, 4)]
    assert [(r["sweep"], r["ranks"]) for r in rows] == [("ranks", 2), ("ranks", 4)]


def test_rows_kept_from_earlier_runs_name_the_run_that_measured_them(tmp_path: Path) -> None:
    """A run of one sweep keeps the other sweeps' rows; rows the previous run had itself kept
    still name the run that measured them, not the previous one."""
    previous = tmp_path / "scale.json"
    rows = [{"sweep": sweep, "figure": sweep} for sweep in ("tensors", "big", "ranks")]
    previous.write_text(
        json.dumps(
            {
                "machine": {"git_commit": "bbbbbbbbbbbbbbbb"},
                "settings": {"tensors": [2000], "big_gb": [1.0], "ranks": [16]},
                "notes": ["the rows of big, ranks are kept from the run of commit aaaaaaaaaa"],
                "records": rows,
            }
        )
    )
    new = [{"sweep": "big", "figure": "new"}]
    kept, notes, settings = cli.keep_other_sweeps(previous, {"big"}, new, [], {"big_gb": [4.0]})
    assert [r["figure"] for r in kept] == ["tensors", "new", "ranks"]
    assert notes == [
        "the rows of tensors are kept from the run of commit bbbbbbbbbb",
        "the rows of ranks are kept from the run of commit aaaaaaaaaa",
    ]
    assert settings["big_gb"] == [4.0] and settings["ranks"] == [16]


def test_the_options_default_by_mode_and_refuse_unknown_sweeps() -> None:
    quick = cli.parse(["--quick"])
    assert quick.repeats == 1 and quick.sweeps == {"tensors", "big", "ranks"}
    chosen = cli.parse(["--tensors", "1_000,2000", "--big-gb", "0.5", "--sweeps", "big"])
    assert chosen.tensors == (1000, 2000) and chosen.big_gb == (0.5,) and chosen.sweeps == {"big"}
    assert cli.parse(["--results"]).out == cli.RESULTS
    with pytest.raises(SystemExit):
        cli.parse(["--sweeps", "tensors,nope"])
    with pytest.raises(SystemExit):
        cli.parse(["--repeats", "0"])


# ----------------------------------------------------------------------------- the report


def test_the_report_has_a_table_row_per_record() -> None:
    lines = scale_report.table(SAMPLE)
    assert lines[0].startswith("| sweep | case | figure | ours | baseline | ratio |")
    assert len(lines) == 2 + len(SAMPLE)
    assert all(line.count("|") == lines[0].count("|") for line in lines)
    assert "| 0.05x | ≤ 0.1x | yes |" in lines[2]  # ratio, target, met
    assert "| 1.50x | ≤ 1.2x | **no** |" in lines[4]
    assert "Many ranks, simulated" in lines[-1] and "—" in lines[-1]
    text = scale_report.markdown(MACHINE, {"repeats": 1}, SAMPLE, ["a note"])
    assert text.startswith("# ") and "3 of 4 targets met" in text
    assert text.rstrip().endswith("Note: a note")


def test_the_outputs_without_matplotlib_have_no_png_and_say_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises
    records = [*SAMPLE, _row("tensors", 10, "stall, full save", float("inf"), 1.0)]
    (tmp_path / "scale.png").write_bytes(b"an earlier run's figure")
    text = scale_report.write_outputs(tmp_path, MACHINE, {"repeats": 1}, records, [])
    assert not (tmp_path / "scale.png").exists()
    assert "matplotlib is not installed" in text
    assert (tmp_path / "scale.md").read_text() == text
    doc = _strict_json((tmp_path / "scale.json").read_text())
    assert set(doc) == {"machine", "settings", "notes", "records"}
    assert len(doc["records"]) == len(records) and doc["records"][-1]["ours"] is None
    assert any("matplotlib" in n for n in doc["notes"])


def test_the_png_plots_cost_against_size(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    text = scale_report.write_outputs(tmp_path, MACHINE, {"repeats": 1}, SAMPLE, [])
    png = tmp_path / "scale.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert "matplotlib" not in text
    scale_report.write_png([], tmp_path / "empty.png")  # no sweep ran: panels say so
    assert (tmp_path / "empty.png").stat().st_size > 0


# ----------------------------------------------------------------------------- the docs page


def test_the_docs_page_has_the_markers_once_in_order() -> None:
    text = PAGE.read_text(encoding="utf-8")
    assert text.count(scale_report.BEGIN) == 1 and text.count(scale_report.END) == 1
    assert text.index(scale_report.BEGIN) < text.index(scale_report.END)
    assert text.startswith("# Scale\n")


def test_the_writer_replaces_only_the_section_between_the_markers(tmp_path: Path) -> None:
    page = tmp_path / "scale.md"
    original = PAGE.read_text(encoding="utf-8")
    page.write_text(original, encoding="utf-8")
    begin, end = scale_report.BEGIN, scale_report.END
    before = original[: original.index(begin)]
    after = original[original.index(end) + len(end) :]

    report = scale_report.markdown(MACHINE, {"repeats": 1}, SAMPLE, ["first run"])
    scale_report.update_docs(page, report)
    text = page.read_text(encoding="utf-8")
    assert text.startswith(before) and text.endswith(after)
    section = text[len(before) : len(text) - len(after)]
    assert section.startswith(begin) and section.endswith(end)
    assert "first run" in section and scale_report.table(SAMPLE)[2] in section
    assert "](../performance/scale.png)" in section
    assert "\n# " not in section, "the report's title is left out"
    assert text.count(begin) == 1 and text.count(end) == 1

    again = scale_report.markdown(MACHINE, {"repeats": 1}, SAMPLE[:2], ["second run"])
    scale_report.update_docs(page, again, figure=False)  # no PNG was written: no link to one
    text = page.read_text(encoding="utf-8")
    assert text.startswith(before) and text.endswith(after)
    section = text[len(before) : len(text) - len(after)]
    assert "second run" in section and "first run" not in text
    assert "scale.png" not in section
    assert text.count(begin) == 1 and text.count(end) == 1
    assert PAGE.read_text(encoding="utf-8") == original, "the real page is left alone"


def test_the_writer_appends_the_section_to_a_page_without_markers(tmp_path: Path) -> None:
    page = tmp_path / "plain.md"
    page.write_text("# Plain\n\nHand-written.\n", encoding="utf-8")
    scale_report.update_docs(page, "# Title\n\nbody text\n")
    text = page.read_text(encoding="utf-8")
    assert text.startswith("# Plain\n\nHand-written.\n\n" + scale_report.BEGIN)
    assert text.rstrip().endswith(scale_report.END) and "body text" in text
    assert "# Title" not in text


# ----------------------------------------------------------------------------- the command


@pytest.mark.slow
def test_the_command_writes_its_report(tmp_path: Path) -> None:
    """End to end at a tiny size, the many-ranks sweep included (its records, or the note
    that it was skipped)."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.suites.scale",
            "--tensors",
            "100",
            "--big-gb",
            "0.002",
            "--ranks",
            "2,4",
            "--repeats",
            "1",
            "--dir",
            str(tmp_path),
            "--out",
            str(tmp_path / "out"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    doc = _strict_json((tmp_path / "out" / "scale.json").read_text())
    assert doc["settings"]["tensors"] == [100] and doc["settings"]["ranks"] == [2, 4]
    assert doc["machine"].get("parallel_scaling") is None or doc["machine"]["parallel_scaling"] > 0
    sweeps = {r["sweep"] for r in doc["records"]}
    assert {"tensors", "big"} <= sweeps
    assert "ranks" in sweeps or any("skipped" in n for n in doc["notes"])
    text = (tmp_path / "out" / "scale.md").read_text()
    assert text.count("\n| ") >= len(doc["records"]) + 1
    assert {p.name for p in tmp_path.iterdir()} == {"out"}, "the scratch directory is removed"


def test_the_durable_note_says_how_many_saves_were_paced() -> None:
    efforts = [("paced", 0.7), ("full", 0.0), ("paced", 0.85), ("fast", 1.0)]
    assert measure.efforts_detail(efforts, ("paced", 0.7)) == (
        'the steady saves timed for durability under codec_effort="auto": 1 of 4 stored their '
        "changed chunks as they are, 1 coded them in full, 2 were paced (stored 70-85 % of them "
        "as they are); the fastest was paced"
    )
