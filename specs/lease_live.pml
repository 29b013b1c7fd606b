/*
 * capstore: liveness of the lease and the 2 x TTL latch
 * (LeaseKeeper::run/step/apply/check_latch, LeaseStore::claim).
 *
 * Publisher P runs its keeper (past the start wait).  A rival R heads the
 * lease and renews it every tick until it stops (at any instant, or never).
 * Before "faults over", P's requests may have unknown outcomes (quarantine for
 * one TTL, fresh lease_id; the late row may land).  Once P is running, P's
 * keeper and the server act before time passes (ttl/6 < one tick): this
 * urgency is the fairness assumption, so every infinite run is fair and the
 * LTL formula needs no -f.
 *
 * Properties:
 *   ltl held_eventually: [] (over && rstop -> <> (held || latched))   (pan -a)
 *   LATCH_ONLY_AFTER_LONG_REFUSAL: P latches only if R kept renewing for at
 *       least TTL - SR ticks after P's first refusal
 *   LATCH_WITHIN_BOUND: if R never stops, P latches within TTL (a quarantine
 *       still running) + 2 x TTL + SR + 2 ticks of the end of faults
 * Variants (controls): LATCH_EARLY latches after one TTL of refusals;
 * STUCK_QUAR never ends a quarantine (refutes held_eventually).
 */
#define TTL 4
#define SK 1
#define SR SK
#ifdef LATCH_EARLY
#define LATCH_AFTER TTL
#else
#define LATCH_AFTER (2*TTL)
#endif
#define CAP (2*TTL+SR+2)

#define NONE 0
#define HELD 1
#define QUAR 2
#define FAILED 3

byte rx = TTL;   /* expiry ticks left of R's row at the head (R holds at start) */
bit  rstop;      /* R stopped renewing (crashed or shut down without release) */
byte px;         /* 15: no row of P at the head; else ticks left of P's row  */
bit  pold;       /* P's row at the head is of an earlier (quarantined) lease_id */
byte pst;
byte q;          /* quarantine ticks left (server, earliest case TTL - SR)    */
bit  refd;       /* refused_since is set                                      */
byte rc;         /* local time since the first refusal, latest case, capped   */
byte rr;         /* ticks R kept renewing after P's first refusal, capped     */
byte ro;         /* ticks since faults were over while R kept renewing, capped */
bit  late;       /* P's claim of unknown outcome may still land               */
bit  over;       /* faults over: no more unknown outcomes                     */
bit  tr;         /* P's keeper acted this tick                                */
bit LATCH_ONLY_AFTER_LONG_REFUSAL;
bit LATCH_WITHIN_BOUND;

#define HLIVE ((rx != 15 && rx > 0) || (px != 15 && px > 0))
#define held (pst == HELD)

/* a latched P (exit code 3) holds nothing; systemd's restart is outside the model.
   With the assertion below, a rival that stopped within TTL - SR of P's first
   refusal cannot have caused a latch, so then P itself eventually holds. */
ltl held_eventually { [] ((over && rstop) -> <> (held || pst == FAILED)) }

init {
  px = 15;
  do
  /* P's keeper: claim (or renew) at head+1; refused while another lease_id is live */
  :: atomic { !tr && (pst == NONE || pst == HELD) ->
       tr = 1;
       if
       :: rx != 15 && rx > 0 ->      /* refused (P's own earlier lease_id is its own spool's: a takeover, not a refusal) */
          pst = NONE;
          if :: !refd -> refd = 1; rc = 0; rr = 0 :: else fi;
          if
          :: rc >= LATCH_AFTER + SR ->    /* check_latch: refused_for >= 2 x TTL (local) */
             assert(rr >= TTL - SR || LATCH_ONLY_AFTER_LONG_REFUSAL);
             pst = FAILED
          :: rc >= LATCH_AFTER - SR && rc < LATCH_AFTER + SR -> pst = FAILED   /* skew: may latch */
          :: rc >= LATCH_AFTER - SR && rc < LATCH_AFTER + SR -> skip
          :: rc < LATCH_AFTER - SR -> skip
          fi
       :: else ->                        /* lands, read-back says held */
          rx = 15; px = TTL; pold = 0; pst = HELD; refd = 0
       fi }
  /* an unknown outcome: quarantine; the claim may land later */
  :: atomic { !over && !tr && (pst == NONE || pst == HELD) -> tr = 1; late = 1; pst = QUAR; q = TTL - SR;
              if :: px != 15 -> pold = 1 :: else fi }
  :: atomic { late -> late = 0;
              if :: !((rx != 15 && rx > 0) || (px != 15 && px > 0)) -> rx = 15; px = TTL; pold = 1 :: else fi }
  :: atomic { !over -> over = 1 }
  /* R stops renewing */
  :: atomic { !rstop -> rstop = 1 }
  /* time: only when P's keeper has acted and no late row is pending */
  :: atomic { (tr || pst == QUAR || pst == FAILED) && !late ->
       tr = 0;
       if :: rx != 15 && !rstop -> rx = TTL :: rx != 15 && rx > 0 -> rx-- :: else fi;
       if :: px != 15 && px > 0 && !pold && pst == HELD -> skip :: px != 15 && px > 0 -> px-- :: else fi;
#ifndef STUCK_QUAR
       if :: pst == QUAR -> if :: q > 1 -> q-- :: else -> q = 0; pst = NONE fi :: else fi;
#endif
       if :: refd && rc < CAP -> rc++ :: else fi;
       if :: refd && !rstop && rr < CAP -> rr++ :: else fi;
       if :: over && !rstop && rx != 15 && ro < TTL + CAP -> ro++ :: else -> ro = 0 fi;
       assert(!(ro >= TTL + CAP && pst != FAILED) || LATCH_WITHIN_BOUND) }
  od
}
