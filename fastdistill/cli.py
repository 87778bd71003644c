"""The ``fastdistill`` command line (placeholder)."""


def main() -> None:
    raise SystemExit("fastdistill CLI: not implemented yet")
