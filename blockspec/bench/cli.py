"""Placeholder until the bench subcommand lands."""


def register(sub) -> None:
    return None
