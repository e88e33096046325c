"""The engine: requests, the FIFO scheduler, the paged KV cache and its blocks, input checks, and the driver's loop.

The submodules are imported by name (`cb_sync.engine.driver`, ...): the runner below the driver reads requests and
the cache from here, so this package imports nothing of its own at load."""
