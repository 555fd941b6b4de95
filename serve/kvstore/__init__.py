"""The disk KV cache: the store's policy (`store`: what is saved, restored, quarantined, its
budget) and the snapshot file format (`snapshot`). The bottom room: it imports no other part of
the server.
"""
