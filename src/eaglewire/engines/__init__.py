"""The serving engines themselves, at their one boundary (`vllm.run_job`), and the commands that check a draft
in them (`serve_check`)."""
