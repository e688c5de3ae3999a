from towerlab.cli import main

raise SystemExit(main())
