from fedtune.evaluate.scores import main

raise SystemExit(main())
