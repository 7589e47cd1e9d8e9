"""`python -m occamy_mtp.data`: the data report of `data.windows`."""

from occamy_mtp.data.windows import main

raise SystemExit(main())
