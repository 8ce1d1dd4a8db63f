from fedtune.tokenize.shards import main

raise SystemExit(main())
