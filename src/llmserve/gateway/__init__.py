"""The serving-plane gateway: auth, RBAC, limits, audit log, content safety.

Imports neither torch nor the engine (DESIGN.md section 1).
"""
