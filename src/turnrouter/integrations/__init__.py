"""Adapters for the voice frameworks turnrouter runs inside.

Each adapter is its own submodule behind an optional extra, so `import turnrouter` (and
this package) never imports a framework: `turnrouter.integrations.pipecat` needs
`pip install 'turnrouter[pipecat]'`.
"""

__all__: list[str] = []
