"""The tensor and spec codec's parts beneath tensors and specs: dtypes, payload bytes, nesting, bounds, dm_env spec conversion."""
