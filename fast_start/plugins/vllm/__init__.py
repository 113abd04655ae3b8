"""vLLM's side of fast-start: `--load-format fast_start` (`loader.py`, its entry point
`register`), the install of cached tensors into vLLM's model (`install.py`), the fill the
daemon's worker runs (`fill.py`), a standby's KV cache (`standby_kv.py`), the artifacts kept
for an engine (`kept.py`), and what differs between vLLM versions (`compat/`).
"""
