"""One module per `treeattn` sub-command.

Each module exposes ``register(subparsers)``, which adds its parser and sets
``func=handler`` on it. A handler takes the parsed ``argparse.Namespace`` and returns an exit
status. Handlers raise :class:`treeattn.errors.UserError` (or a package's own error: every one
derives from :class:`treeattn.errors.TreeattnError`) for bad input; the CLI turns that into
one ``error: ...`` line.
"""

# Order here is the order `treeattn --help` lists the commands in.
COMMAND_MODULES = (
    "treeattn.commands.topo",
    "treeattn.commands.predict",
    "treeattn.commands.comm",
    "treeattn.commands.run",
    "treeattn.commands.generate",
    "treeattn.commands.sweep",
    "treeattn.commands.demo",
)

# Which module registers each sub-command, so the CLI imports only the one it runs (torch is
# slow to import, and `treeattn topo ...` should not pay for it).
COMMAND_OWNERS = {
    "topo": "treeattn.commands.topo",
    "predict": "treeattn.commands.predict",
    "plan": "treeattn.commands.predict",
    "comm": "treeattn.commands.comm",
    "run": "treeattn.commands.run",
    "calibrate": "treeattn.commands.run",
    "generate": "treeattn.commands.generate",
    "sweep": "treeattn.commands.sweep",
    "demo": "treeattn.commands.demo",
}
