"""The node checkpoint agent (peer-memory tier): server, buddy replication, memory store,
running it as a child process. ``python -m tidal.ckpt.agent`` starts one; importing this
package does not load torch."""
