from fedtune.download.fetch import main

raise SystemExit(main())
