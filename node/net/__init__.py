"""The network layer shared by every member and the tracker: TLS 1.3 streams,
swarm trust (CA, certificates, the trainer key), framed authenticated
connections, rate limits, the standing tracker link, and running a member as
a service. Imports nothing from the rest of node/ nor from tracker/."""
