"""Drivers that prove, never imported by a replica: the batch-invariance audits, the records they write, the golden
table's recorder and the parallel-render prototype.

diffusion.py, llm.py, video.py   the audits (`omniserve audit`): measured, not asserted
real_width.py                    the families' denoisers and VAE decoders at public widths (`omniserve audit --real-width`)
parallel.py, parallel_render.py  one image on several workers (issue 27's prototype) and its audit
record.py, report.py             scope records from an audit (`--record`); the report's environment, tables, outputs
golden.py                        the golden table's recorder (`omniserve golden [--record]`); the canonical requests
                                 and the start-up self-check are served code (stages/*/self_check.py)
"""
