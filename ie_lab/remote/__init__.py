"""Remote sessions: `ie-lab serve` runs one Session behind an HTTP API (server.py); ie_lab.connect(url, token=...)
returns a Session whose backend talks to it (client.py). wire.py is the format both sides share, ops.py the closed
list of operations and their arguments. See docs/REMOTE.md."""
