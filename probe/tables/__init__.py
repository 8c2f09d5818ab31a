"""Virtual tables over the live state of this process: specs, the registry, and the built-in tables."""

from probe.tables.registry import (get_table, list_tables, produce_columns, produce_rows, register_table,
                                   unregister_table)
from probe.tables.spec import COLUMN_TYPES, Column, TableSpec

__all__ = ["Column", "TableSpec", "COLUMN_TYPES", "register_table", "unregister_table", "get_table",
           "list_tables", "produce_rows", "produce_columns"]
