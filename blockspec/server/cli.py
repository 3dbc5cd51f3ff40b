"""Placeholder until the server subcommand lands."""


def register(sub) -> None:
    return None
