"""The wire: every record that crosses a process boundary (client <-> coordinator, coordinator <-> worker), its
msgpack codec and the ZMQ transport. Imported by every process; it imports only settings/."""
