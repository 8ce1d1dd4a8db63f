from fedtune.aggregate.merge import main

raise SystemExit(main())
