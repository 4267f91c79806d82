"""Prompt data: the JSONL prompt datasets (``dataset``), their checks before start-up
(``prompt_check``), the tokenizer adapters that turn a prompt into ids (``tokenizer``) and the
embedded digit task (``task``)."""
