"""What the proxy shows of itself: Prometheus metrics, the /stats figures and the
dashboard page (package data), requests counted per client API."""
