"""Structured outputs (JSON schema, regex, choice, EBNF grammar) with xgrammar."""
