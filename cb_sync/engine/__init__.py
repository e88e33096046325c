"""The top floor: the driver's loop (`driver`), its input checks, and one driver call at a time.

The submodules are imported by name (`cb_sync.engine.driver`, ...). `kv_cache`, `block_allocator`, `request` and
`scheduler` are the old paths of what now lives in `cb_sync.cache` and `cb_sync.scheduler`."""
