from eval.quality.cli import main

raise SystemExit(main())
