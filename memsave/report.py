"""STUB"""
class RewriteReport:
    pass


def last_report():
    return None
