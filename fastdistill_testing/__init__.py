"""The test harness: real vLLM servers side by side, HTTP stubs, synthetic scored samples, spawned ranks, the
end-to-end runs' set-up and namespaced hosts for the multi-host tests. It lives at the repository root and is not
installed with the wheel: the tests (pytest's ``pythonpath``) and the benchmarks put the root on the path."""
