_ARGS = None


def get_args():
    return _ARGS


def set_args(args) -> None:
    global _ARGS
    _ARGS = args
