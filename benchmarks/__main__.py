from benchmarks.suites.side_by_side import main

raise SystemExit(main())
