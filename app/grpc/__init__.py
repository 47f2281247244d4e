"""TEI's gRPC API (tei.v1) in front of the service: tei.proto, its generated code
(app/grpc/generate.py, at install time), the servicer (service.py) and the server (server.py)."""
