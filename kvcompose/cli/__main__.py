from kvcompose.cli.main import main

raise SystemExit(main())
