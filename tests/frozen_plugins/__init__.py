"""Plugins written against earlier HAL contracts, kept unchanged forever (test fixtures).

``acme_hal_1_0`` follows the HAL 1.0 contract and ``acme_hal_1_1`` the HAL 1.1 contract, as each
was documented when it shipped. NEVER edit them to follow the current HAL: the promise they test
is that within a major version a plugin built for any earlier minor version loads and serves what
it implements (dsv4core/hal/CHANGELOG.md). If a change to dsv4core breaks them, the change is
what needs fixing (or a new major version).
"""
