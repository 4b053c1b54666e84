"""Cost against size: ``python -m benchmarks.suites.scale [--quick] [--results]``.

Three sweeps, each figure of ours a ratio to its baseline measured in the same run:

* **Many tensors** (``--tensors``, default 2,000 and 20,000 tensors of 4 KiB, float32, in
  ``{"model": {"layers.{i // 8}.w{i % 8}": t}}``). Three saves into one store: the first (a full
  base), the second of the unchanged state, the third with 1 % of the tensors changed. Figures:
  the stall of each ``save`` call against the whole of ``torch.save`` + fsync; the time to
  durable (``save`` to ``result()``) against ``torch.save`` + fsync; the restore in a fresh
  process (``CheckpointStore(url).load()``; only the load is timed, not the imports) against
  ``torch.load`` in a fresh process; the bytes of the unchanged save's manifest per tensor.
* **Big state** (``--big-gb``, default 1 GB in 8 float32 tensors). Five saves, every tensor
  changed in place (``add_(1)``: a dense update) before each after the first. Figures: the
  stall of the third save (steady state: snapshot buffers recycled) against copying the state
  into buffers that already exist (``dst.copy_(src)``, the memory-bandwidth bound, timed right
  before that save); the time
  to durable of the steady saves (the third on) against ``torch.save`` + fsync after each;
  restores in a fresh process of the full base (the first save) and of the end of the chain
  of five against ``torch.load`` (with what the chain's end is made of, see
  :func:`chain_makeup`); the peak extra host memory of the first save (snapshot
  buffers allocated) and of the fourth (recycled), as a multiple of the state
  (``benchmarks.harness.memory``: ``VmHWM``), beside ``torch.save``'s.
* **Many ranks, simulated**: the records of ``benchmarks.suites.scale.ranks.run(ranks=...)``
  (commit time against ranks), skipped with a note where that module is absent.

Times are the best of ``--repeats``; every store is on the same local disk as the baseline's
files (``--dir``), with fsync on. ``torch.save`` + fsync runs after each of our saves (the same
disk state for both), each into a new file kept until the sweep's attempt ends, as our saves
write new objects (see :func:`new_file_save`). Writes ``scale.{json,md,png}`` under ``--out``
(default ``bench_out/scale/``); ``--results`` writes them to ``benchmarks/results/`` and
regenerates the results section of ``docs/guides/scale.md``.

The parts: ``figures`` (a figure's record and its target), ``measure`` (a timed save, a restore
in a fresh process, ``torch.save`` into a new file), ``tensors``, ``big`` and ``ranks`` (the
sweeps), ``cli`` (the command; ``__main__`` runs it).
"""
