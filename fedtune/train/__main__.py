from fedtune.train.distributed import leave
from fedtune.train.loop import main

leave(main())
