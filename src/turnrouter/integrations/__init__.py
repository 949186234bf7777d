"""Adapters for the voice frameworks turnrouter runs inside (optional extras).

Each adapter is its own submodule behind an extra, so `import turnrouter` (and this
package) never imports a framework: `turnrouter.integrations.pipecat` needs the
`pipecat` extra, `turnrouter.integrations.livekit` the `livekit` extra (from a checkout:
`pip install -e '.[pipecat]'`; or a built wheel with `[pipecat]`).
"""
