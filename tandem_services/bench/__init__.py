"""The serving load generator (`tandem bench serve` = `python -m tandem_services.bench.serve`): it
launches or reaches the services, so it lives with them."""
