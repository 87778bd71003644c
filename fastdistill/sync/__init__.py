"""Weight sync from the trainer into the student's vLLM server through vLLM's weight-transfer API."""
