"""Models built locally (the demo model, tiny random-weight models of other families)
and the terminal's view of a proxy (`kvroute stats`)."""
