"""How a message tells the user to install one of tfmem's extras, as tfmem installs today."""


def install_command(extra: str) -> str:
    """`install_command("plot")` → "`pip install -e '.[plot]'` in a checkout of tfmem".

    tfmem installs from its repository (it is on no package index), so every message that
    names an extra names this command.
    """
    return f"`pip install -e '.[{extra}]'` in a checkout of tfmem"
