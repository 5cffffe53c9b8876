"""Where bytes live: the unified device page pool (memory/page_pool.py) and, later, the host pools."""
