from benchmarks.suites.scale.cli import main

raise SystemExit(main())
