"""Adapters for the voice frameworks turnrouter runs inside (optional extras).

Each adapter is its own submodule behind an extra, so `import turnrouter` (and this
package) never imports a framework: `turnrouter.integrations.pipecat` needs
`pip install 'turnrouter[pipecat]'`, `turnrouter.integrations.livekit`
`pip install 'turnrouter[livekit]'`.
"""
