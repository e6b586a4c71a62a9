"""Which backend serves a request: the routing policies behind one interface
(interface.py, policies.py), the pure cost function and placement they use (cost.py,
placement.py), and this proxy's own recent choices (recent.py)."""
