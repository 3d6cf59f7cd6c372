"""Forced tags and call-block tags (constrained/structural_tag.py) as xgrammar structural-tag formats.

A forced tag is ``prefix``, the calls (``TagsWithSeparatorFormat``), ``suffix``, or with
``answer_schema`` that or one JSON value of it (``OrFormat``). A call block is a
``TriggeredTagsFormat`` whose tag is the block (the calls between prefix and suffix, or each call
itself when there is no prefix); with ``stop_after_first`` one block of one call, which ends the reply.
``bare_start`` has no xgrammar form (its free text would have to exclude an opening ``{``): refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import xgrammar as xg

from radixlang.constrained.errors import UnsupportedGrammar
from radixlang.constrained.structural_tag import PARAM, StructuralTagSpec


def _call_tags(tag: StructuralTagSpec, schemas: Sequence[Any]) -> list[Any]:
    st = xg.structural_tag
    return [st.TagFormat(begin=s.begin, content=st.JSONSchemaFormat(json_schema=schema), end=s.end)
            for s, schema in zip(tag.structures, schemas)]


def _calls(tag: StructuralTagSpec, schemas: Sequence[Any]) -> Any:
    return xg.structural_tag.TagsWithSeparatorFormat(tags=_call_tags(tag, schemas), separator=tag.separator,
                                                     at_least_one=True, stop_after_first=tag.stop_after_first)


def forced_tag_format(tag: StructuralTagSpec, schemas: Sequence[Any], answer_schema: Any = None) -> Any:
    st = xg.structural_tag
    parts = [st.ConstStringFormat(value=tag.prefix)] if tag.prefix else []
    parts += [_calls(tag, schemas)] + ([st.ConstStringFormat(value=tag.suffix)] if tag.suffix else [])
    calls = parts[0] if len(parts) == 1 else st.SequenceFormat(elements=parts)
    if answer_schema is None:
        return st.StructuralTag(format=calls)
    return st.StructuralTag(format=st.OrFormat(elements=[calls, st.JSONSchemaFormat(json_schema=answer_schema)]))


def block_tag_format(tag: StructuralTagSpec, schemas: Sequence[Any]) -> Any:
    st = xg.structural_tag
    if tag.bare_start:
        raise UnsupportedGrammar("structural_tag: bare_start (calls as bare JSON at the reply's start, as llama3 "
                                 "writes them) cannot be written by the xgrammar grammar backend; llguidance "
                                 "can", PARAM)
    trigger = tag.triggers[0]
    if tag.prefix:
        tags = [st.TagFormat(begin=tag.prefix, content=_calls(tag, schemas), end=tag.suffix)]
    else:  # each call opens with the trigger: the calls are the tags
        tags = _call_tags(tag, schemas)
    # stop_after_first: xgrammar ends the reply after the one call (text after it would need a second format)
    return st.StructuralTag(format=st.TriggeredTagsFormat(triggers=[trigger], tags=tags, at_least_one=False,
                                                          stop_after_first=tag.stop_after_first))
