"""``accelerate launch [accelerate options] -m accelerate_incremental [--dirpath URL | --config
FILE] train.py [script args]``: see :mod:`accelerate_incremental._launch`."""

from __future__ import annotations

from accelerate_incremental._launch import main

if __name__ == "__main__":
    main()
