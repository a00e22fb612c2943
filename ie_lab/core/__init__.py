"""The neutral core: what every backend shares and none owns.

Input checks, address parsing, result types, steering specs and their scopes, sampling and projection argument
checks, model handles. Both backends (ie_lab/eager/, ie_lab/vllm/) import these modules; they import neither
backend, nor the sessions, nor the package's __init__ (tests/test_import_contract.py holds them to it).
"""
