from fedtune.train.loop import main

raise SystemExit(main())
