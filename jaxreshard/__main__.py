from jaxreshard._cli import main

raise SystemExit(main())
