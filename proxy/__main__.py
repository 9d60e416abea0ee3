"""`python -m proxy` runs the tito-proxy command."""

from proxy.cli import main

raise SystemExit(main())
