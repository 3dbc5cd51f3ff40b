"""Placeholder until the train subcommand lands."""


def register(sub) -> None:
    return None
