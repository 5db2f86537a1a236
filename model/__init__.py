"""The model, run in the worker processes: a pure forward of (input_ids, positions); paging and batching live
outside it."""
