from fedtune.report.build import main

raise SystemExit(main())
