"""Prompt sets and corpora: built-in prompt sets, MT-Bench, the standard-library corpus, instruction prompts."""
